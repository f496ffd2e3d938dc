"""Verifiers: choose the accepted path of a token tree from the target's distributions."""
