"""The comparator: meets each live layer call with its golden call and asks a judge, per leaf kind."""
