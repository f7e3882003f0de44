"""``clawcomm experiment ...``: experiments that train real models on local ranks."""
