from dsuf.cli import main

main()
