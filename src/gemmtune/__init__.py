"""gemmtune"""
