"""The simulated GPU: device specs, the roofline cost model, the simulated engine loop on a virtual clock,
kernel launches, host-side preprocessing and inter-token gaps.
"""
