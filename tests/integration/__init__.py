"""The whole trainer run end to end, checked against something outside it: a plain reference, real checkpoints,
several processes, a GPU, every architecture, features combined."""
