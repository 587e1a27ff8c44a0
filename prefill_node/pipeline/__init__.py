"""Pipeline-parallel prefill. Roles, one word each: the *first stage* (rank 0, talks to the
router: :mod:`.first`, :mod:`.first_runner`), a *later stage* (rank >= 1: :mod:`.later`,
:mod:`.service`), the *link* from a stage to the next one (:mod:`.link`) and the *layout* of
layers over stages (:mod:`.layout`); :mod:`.server` starts either kind of process."""
