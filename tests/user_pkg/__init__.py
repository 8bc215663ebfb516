"""A user's own code outside the package, as a run names it (``module:Class``): the tests import
it the way the loop's actors do."""
