"""Looking inside a trained model: attention maps and the causality demonstration."""
