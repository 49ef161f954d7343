"""Drafter training: regenerated answers → target cache → training runs → evaluation."""
