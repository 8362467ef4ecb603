"""Token-budget batching: epoch planning, the sampler and dataloader, loss normalisation across ranks."""
