"""Files written whole: temporaries named after their writer, and how to tell one whose writer died."""
