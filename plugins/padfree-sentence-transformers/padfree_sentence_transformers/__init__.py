"""padfree-sentence-transformers: padding-free sentence-transformers with any attention backend.

    import padfree_plugins, padfree_sentence_transformers as pst

    with pst.enable(model, {"attention": "exact"}):     # SentenceTransformer or CrossEncoder
        embeddings = model.encode(texts)                # packed rows, same embeddings as padded
    pst.encode(model, texts)                            # the same, in one call (also pst.predict)

    padfree_plugins.accelerate(trainer, cfg)            # SentenceTransformerTrainer / CrossEncoderTrainer
"""

from .model import PadfreeModel, enable, encode, predict

__all__ = ["PadfreeModel", "enable", "encode", "predict"]
