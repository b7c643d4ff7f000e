"""Speculative decoding: draft proposers that guess a request's next tokens for the model to verify."""
