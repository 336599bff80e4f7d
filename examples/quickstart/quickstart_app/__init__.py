"""Flower's PyTorch quickstart, switched to pflower's FedAlt, APFL or PFLEGO."""
