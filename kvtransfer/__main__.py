from kvtransfer.cli import main

raise SystemExit(main())
