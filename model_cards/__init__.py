"""Model card templates, installed as ``hf_dspark.model_cards`` (read by :mod:`hf_dspark.cards`)."""
