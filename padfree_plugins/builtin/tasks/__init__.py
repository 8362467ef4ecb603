"""Builtin task plugins: hidden_states, causal_lm, seq_cls, reranker, embedding."""
