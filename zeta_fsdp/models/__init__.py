"""Small models shipped with the package: the demo, the planner's examples and the docs use them."""
