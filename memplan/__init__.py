"""memplan: plan memory and step time for training small language models, before anything runs."""

__version__ = "0.1.0"
