"""Step-3.7 text decoder (arrives with the model issue)."""
