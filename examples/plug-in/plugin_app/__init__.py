"""A quickstart-style Flower app that switches to pflower's FedAlt in a few lines."""
