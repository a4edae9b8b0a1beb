"""Data formats shared by the preprocess writer and the training reader."""
