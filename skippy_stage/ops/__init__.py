"""Operations: planning a split over nodes by memory, and the files that deploy it."""
