"""engines/cpu"""
