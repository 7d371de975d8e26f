"""The app's tabs, one a file: Dashboard, X-Ray, Narrator, Tutorial, Block Map."""
