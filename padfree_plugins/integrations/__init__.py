"""Trainer integrations: ``accelerate(trainer, cfg)``, the shared trainer patch, and one plugin per trainer."""
