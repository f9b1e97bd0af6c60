from tpuctl.cli import main

main()
