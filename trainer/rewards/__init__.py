"""trainer.rewards"""
