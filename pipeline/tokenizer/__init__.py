"""Loading tokenizers from their files and encoding with them: one home that preprocess, train,
convert and export all import without importing each other."""
