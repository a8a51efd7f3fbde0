"""Compiler passes that turn a Program into what a Plan runs (placement, ...)."""
