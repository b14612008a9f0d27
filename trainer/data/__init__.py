"""trainer.data"""
