"""hbp_train/perf"""
