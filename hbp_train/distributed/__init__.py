"""hbp_train/distributed"""
