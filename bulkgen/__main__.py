from bulkgen.cli import main

main()
