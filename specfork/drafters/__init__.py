"""Drafters: plug-ins that propose candidate continuations for the target to verify."""
