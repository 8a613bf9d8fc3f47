"""hbp_train/planning/baselines"""
