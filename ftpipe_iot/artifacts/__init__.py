"""The trained model in users' hands: standard checkpoints, deployment exports, evaluation."""
