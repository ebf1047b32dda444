"""paravt_kernels"""
