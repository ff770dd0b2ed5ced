"""Stage 6, report: ``cells.csv`` written as cells finish, output-directory rules and resume,
``summary.md`` and the closing table."""
