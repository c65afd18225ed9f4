"""NEXTN (multi-token prediction): the target checkpoint's MTP layer drafts a chain that the
target verifies in one forward. :mod:`.worker` runs the round, :mod:`.args` owns its flags."""
