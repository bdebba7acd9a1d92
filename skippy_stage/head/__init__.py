"""The head layer: stage 0's generation loop — the iteration-level scheduler and the text front."""
