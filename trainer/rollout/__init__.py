"""trainer.rollout"""
