from ddlscope.cli import main

main()
