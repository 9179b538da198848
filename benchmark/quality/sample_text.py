"""A short public-domain text that ships in the repository, for tests and smoke runs.

The opening of *Pride and Prejudice* (Jane Austen, 1813): enough for a few hundred
tokens without the Austen package or a network.
"""

PRIDE_AND_PREJUDICE_OPENING = (
    "It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in "
    "want of a wife.\n\nHowever little known the feelings or views of such a man may be on his first entering a "
    "neighbourhood, this truth is so well fixed in the minds of the surrounding families, that he is considered "
    "the rightful property of some one or other of their daughters.\n\n\"My dear Mr. Bennet,\" said his lady to "
    "him one day, \"have you heard that Netherfield Park is let at last?\"\n\nMr. Bennet replied that he had not."
    "\n\n\"But it is,\" returned she; \"for Mrs. Long has just been here, and she told me all about it.\"\n\nMr. "
    "Bennet made no answer.\n\n\"Do you not want to know who has taken it?\" cried his wife impatiently.\n\n"
    "\"_You_ want to tell me, and I have no objection to hearing it.\"\n\nThis was invitation enough.\n\n\"Why, "
    "my dear, you must know, Mrs. Long says that Netherfield is taken by a young man of large fortune from the "
    "north of England; that he came down on Monday in a chaise and four to see the place, and was so much "
    "delighted with it, that he agreed with Mr. Morris immediately; that he is to take possession before "
    "Michaelmas, and some of his servants are to be in the house by the end of next week.\"\n\n\"What is his "
    "name?\"\n\n\"Bingley.\"\n\n\"Is he married or single?\"\n\n\"Oh! Single, my dear, to be sure! A single man "
    "of large fortune; four or five thousand a year. What a fine thing for our girls!\"\n\n\"How so? How can it "
    "affect them?\"\n\n\"My dear Mr. Bennet,\" replied his wife, \"how can you be so tiresome! You must know "
    "that I am thinking of his marrying one of them.\"\n\n\"Is that his design in settling here?\"\n\n\"Design! "
    "Nonsense, how can you talk so! But it is very likely that he _may_ fall in love with one of them, and "
    "therefore you must visit him as soon as he comes.\""
)
