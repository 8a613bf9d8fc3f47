"""hbp_train/profiler"""
