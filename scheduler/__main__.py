from scheduler.cli.commands import main

raise SystemExit(main())
