"""Analysis: recorded runs read back, reports, next-optimization advice, seed claims."""
