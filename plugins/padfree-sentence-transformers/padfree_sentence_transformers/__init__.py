"""padfree-sentence-transformers: padding-free sentence-transformers with any attention backend.

    import padfree_plugins, padfree_sentence_transformers as pst

    with pst.enable(model, {"attention": "exact"}):     # SentenceTransformer, SparseEncoder or CrossEncoder
        embeddings = model.encode(texts)                # packed rows, same embeddings as padded
    pst.encode(model, texts)                            # the same, in one call (also pst.predict)
    pst.disable(model)                 # undo an enable() not used as a context manager (or a copy's)

    padfree_plugins.accelerate(trainer, cfg)            # SentenceTransformer-, SparseEncoder-, CrossEncoderTrainer
"""

from .model import PadfreeModel, disable, enable, encode, predict

__all__ = ["PadfreeModel", "disable", "enable", "encode", "predict"]
