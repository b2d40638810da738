"""Model core: config, checkpoint loading, quantisation codecs, the reference forward pass."""
