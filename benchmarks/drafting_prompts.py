"""The drafting benchmark's prompts (benchmarks/bench_drafting.py): paragraphs with a few spelling
mistakes for the editing workload, whose answers copy their prompts, and open questions for the
chat workload, whose answers do not. Plain data; nothing here talks to a server.
"""

EDIT_INSTRUCTION = "Fix the spelling mistakes and return the whole paragraph, nothing else."

PARAGRAPHS = (
    "The old lighthouse stood at the edge of the cliff for more then a hundred years. Every "
    "nigth its keeper climbed the narrow stairs, carried oil for the lamp and wiped the salt "
    "from the big glass lens. Ships passing the rocks below could see the beam from twenty miles "
    "away, and many sailors owed their lives to that steady light. When the keeper grew old, the "
    "town decided to replace the lamp with an electric one that needed no one to tend it. The "
    "keeper moved into a small house by the harbour, but he still walked up the hill each evening "
    "to watch the light come on by itself. He said it felt strange to have nothing to do, like a "
    "musician who hears his song played by someone else. Children from the school visited him on "
    "Fridays, and he told them storys about storms, wrecks and the winter when the sea froze near "
    "the shore. Years later the lighthouse became a museum, and his old logbook was placed in a "
    "glass case near the entrance, open at the page that recorded his very first nigth on duty.",

    "Every morning at four o'clock, Maria unlocks the door of the little bakery on Station Road "
    "and turns on the ovens. The dough for the bread has been resting since the evening before, "
    "and the whole room smells of yeast and warm flour. She shapes the loaves by hand, because "
    "she beleives that machines press out the air that makes the crumb light. By six o'clock the "
    "first customers are waiting outside: builders on their way to work, nurses coming home from "
    "the night shift, and an old man who buys one croissant and reads the newspaper at the window "
    "table. Maria knows most of them by name and remembers how they like their coffee. On "
    "Saturdays her nephew helps at the counter, although he eats almost as many pastries as he "
    "sells. The bakery is not large and it will never make her rich, but she says she would not "
    "change it for any job in the city. When people ask for her secret recipe, she laughs and "
    "tells them that the only secret is patience and a good nights sleep, wich she rarely gets.",

    "Cycling to work has become much more popular in our city over the last five years. The "
    "council built new bike lanes along the river and across the main bridge, and it painted "
    "clear signs at the busiest junctions. At first many drivers complained that the lanes took "
    "space away from cars, but the traffic jams did not get worse, and the air near the schools "
    "is now noticably cleaner. A small repair shop opened next to the railway station, where "
    "commuters can leave their bicycles in the morning and collect them, fixed and oiled, in the "
    "evening. The shop also runs free classes on Tuesday evenings, teaching people how to change "
    "a tyre, adjust their brakes and choose a good lock. Not everything is perfect. Some lanes "
    "end suddenly in the middle of a busy street, and in winter the paths are rarely cleared of "
    "snow and ice. Still, the number of people who ride every day has more than doubled, and the "
    "council has promised to finish the missing connections before the end of next year, if the "
    "budjet allows it.",

    "Growing your own vegetables does not require a big garden. A sunny balcony with a few deep "
    "pots is enough for tomatoes, peppers, lettuce and most kitchen herbs. The most important "
    "thing is light: tomatoes need at least six hours of direct sun each day, otherwise the "
    "plants grow tall and thin and produce very little fruit. Use good compost rather than soil "
    "from the park, and make sure every pot has holes in the bottom so that the water can drain "
    "away. Water in the early morning or late evening, when less of it evaporates, and try to "
    "keep the soil evenly moist rather then soaking it once a week. Herbs such as basil and "
    "parsley can be picked often; cutting the top leaves makes them grow bushier. Lettuce is "
    "happy in partial shade and can be sown again every few weeks for a continous supply. In the "
    "autumn, empty the pots, mix fresh compost into the old soil and cover it, so it is ready for "
    "next spring. With a little care, even a small balcony can give you fresh salad for most of "
    "the sumer.",

    "Last summer my sister and I took the night train from Vienna to the coast. We had booked a "
    "small compartment with two narrow beds, a tiny sink and a window that opened just enough to "
    "let in the cool air. The train left a little after nine in the evening, and for the first "
    "hour we watched the lights of the suburbs give way to dark fields and sleeping villages. The "
    "conductor brought us tea and a paper bag with bread, cheese and an apple for breakfast. I "
    "expected to lie awake all night, but the gentle rocking of the carriage put me to sleep "
    "almost immediatly. When I woke up, the landscape had changed completely: steep green hills, "
    "stone bridges and, finally, a narrow strip of blue sea between the mountains. We arrived at "
    "half past seven, rested and hungry, with the whole day in front of us. Flying would have "
    "been faster, of course, but it would not have felt like the start of a real jorney. Next "
    "year we want to try the sleeper train to the north, where the sun hardly sets in June.",

    "The public library in our neighbourhood is much more than a place to borrow books. On "
    "Monday mornings it hosts a group for parents with babies, who sing songs and share advice "
    "about sleepless nights. In the afternoons, students fill the long tables by the windows, "
    "working on their homework with the free internet. Twice a month a volunteer helps older "
    "residents use their phones and computers, explaining how to make video calls to their "
    "grandchildren or pay bills online. The library also lends things you might not expect: "
    "tools, board games, sewing machines and even a telescope, which is booked for weeks ahead "
    "whenever there is a clear sky. Last year the city wanted to reduce its opening hours to save "
    "money, but hundreds of people signed a letter asking the council to keep it open in the "
    "evenings. The council listened, and the hours stayed the same. The librarian says the "
    "building is busier now then it has ever been, and she hopes that the next generation will "
    "grow up thinking of it as there second living room.",

    "We started the climb just after sunrise, when the air in the valley was still cold and the "
    "grass was wet with dew. The path followed a stream for the first hour, crossing it twice on "
    "wooden bridges that moved slightly under our weight. Higher up, the trees became smaller "
    "and further apart until there were only low bushes, rocks and the occasional patch of old "
    "snow. We stopped for lunch beside a small lake so clear that we could see the stones on the "
    "bottom, and a pair of curious birds waited nearby for crumbs. The last part of the route was "
    "the hardest: a steep slope of loose stones where every step seemed to slide half a step "
    "back. My legs were shaking when we finally reached the top, but the view made every effort "
    "worthwile. To the south we could see three other peaks, still white, and to the north the "
    "whole valley we had walked through, with our village a tiny cluster of roofs far below. We "
    "took a few photographs, ate the last of the chocolate and began the long decent before the "
    "clouds came in.",

    "When our company allowed everyone to work from home three days a week, many of us were not "
    "sure it would work. The first weeks were dificult. Meetings started late because someone's "
    "microphone did not work, and it was hard to know whether a colleague was busy or simply had "
    "not seen a message. Slowly we found better habits. Each team now writes a short plan every "
    "Monday, so that everyone knows who is doing what, and we keep the video meetings under "
    "thirty minutes whenever possible. The office itself has changed as well: fewer desks, more "
    "rooms for small groups, and a quiet area where people can concentrate without headphones. "
    "Most people say they are happier with the new arrangement, mainly because they spend less "
    "time commuting and have more time for there families. Managers were worried that "
    "productivity would fall, but the numbers from the first year show the opposite. The biggest "
    "challenge now is making sure that new employees still get to know their colleagues, since "
    "it is much harder to ask a quick question when you have never met in person.",
)

QUESTIONS = (
    "Write a short story about a robot who learns to paint.",
    "Explain why the sky is blue, in simple terms.",
    "What are three good habits for staying healthy when you work at a desk all day?",
    "Describe how a new law is usually made in a parliament.",
    "Write a poem about autumn in a big city.",
    "Give me some ideas for the birthday party of a ten-year-old who loves dinosaurs.",
    "Explain the difference between weather and climate.",
    "What should I pack for a week of camping in the mountains?",
)
