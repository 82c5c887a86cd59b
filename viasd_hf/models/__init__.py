"""Models as viasd_hf loads and measures them: loading, the offline zoo, quantisation, this machine, pass costs."""
