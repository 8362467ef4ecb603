"""The model side: patching, attention backends, the probe, pooling, per-example heads, the forward, NEFTune."""
