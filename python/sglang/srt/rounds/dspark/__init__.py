"""DSpark: a block drafter whose confidence head lets a planner choose each request's verify
length. :mod:`.worker` runs the round; :mod:`.setup` validates the draft and the planner's
tables; :mod:`.planner`, :mod:`.verify`, :mod:`.sps`, :mod:`.sts` and :mod:`.paged_context`
are its parts; :mod:`.args` owns its flags."""
