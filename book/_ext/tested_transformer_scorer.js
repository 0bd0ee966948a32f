// The search page's scores (Sphinx's html_search_scorer; tested_transformer_search.py sets
// it). Sphinx's own weights, and two changes to how results are ordered:
// - Only an index entry that is exactly the query scores high (100): a chapter's key term.
//   One that merely contains it ("self-attention" for "attention") scores as a heading does,
//   15, not 50 to 99, so that a long entry does not lift a page above those that treat the
//   word in a heading.
// - Results of equal score come in the book's order (chapter 4 before chapter 10, then the
//   other pages), not sorted by title as text, where "10. ..." comes before "4. ...".
var Scorer = {
  score: (result) => {
    const [docname, , , , score] = result;
    let s = score >= 50 && score < 100 ? 15 : score;
    const chapter = /(?:^|\/)(\d+)_[^/]*$/.exec(docname);
    // Less than any difference between Sphinx's scores (whole numbers).
    s -= chapter ? Number(chapter[1]) / 1000 : 0.5;
    return s;
  },
  objNameMatch: 11,
  objPartialMatch: 6,
  objPrio: {0: 15, 1: 5, 2: -5},
  objPrioDefault: 0,
  title: 15,
  partialTitle: 7,
  term: 5,
  partialTerm: 2,
};
