from moe_kernels.env import report

print(report())
