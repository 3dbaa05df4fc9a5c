from moe_kernels.train.cli import main

main()
